"""The shared command-line types refuse out-of-bound values at parse time."""

import argparse

import pytest

from pagoda.entrypoints import argtypes


@pytest.mark.parametrize("fn, good, bad", [
    (argtypes.positive_int, {"1": 1, "64": 64}, ["0", "-3"]),
    (argtypes.non_negative_int, {"0": 0, "7": 7}, ["-1"]),
    (argtypes.positive_float, {"0.5": 0.5}, ["0", "-1", "inf", "nan"]),
    (argtypes.non_negative_float, {"0": 0.0, "2.5": 2.5}, ["-0.1", "inf", "nan"]),
    (argtypes.byte_size, {"512MiB": 512 << 20, "1GB": 10**9, "4096": 4096}, ["0", "-1GiB"]),
    (argtypes.non_negative_byte_size, {"0": 0, "2GiB": 2 << 30}, ["-1"]),
])
def test_bounds(fn, good, bad):
    for text, value in good.items():
        assert fn(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


def test_a_refused_value_is_a_usage_error_naming_the_flag(capsys):
    parser = argparse.ArgumentParser(prog="pagoda serve")
    parser.add_argument("--max-loaded-models", type=argtypes.positive_int)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--max-loaded-models", "0"])
    assert exc.value.code == 2
    assert "--max-loaded-models" in capsys.readouterr().err
