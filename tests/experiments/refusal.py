"""The experiment drivers' refusal tests, written once: an argument error exits with argparse's code 2, naming the
bad value, before the driver runs anything (the work it would run is replaced by a failure)."""

import pytest


def refuse_to_run(monkeypatch, module, name: str) -> None:
    """module.name fails the test if called: an argument error must stop the driver before it."""

    def ran(*args, **kwargs):
        pytest.fail(f"{module.__name__}.{name} ran: an argument error must stop the driver before it")

    monkeypatch.setattr(module, name, ran)


def assert_refused(main, argv: list[str], message: str, capsys) -> None:
    """main(argv) exits with code 2 and `message` in its stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
