"""The error a bad request field raises, shared by every layer that validates one (sampling
parameters, structured-output specs, the input processor, the API translators), so none of
them imports another for it. Pure Python; ``pagoda.sampling_params`` re-exports both names."""
from __future__ import annotations


class ParamError(ValueError):
    """A ``ValueError`` about one request field; ``param`` names it (the API error's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)
