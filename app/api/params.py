"""Query parameters that take one value: given twice, the request is refused with a 422
naming the parameter, instead of one of the values being taken silently."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError


def single_valued(*names: str) -> Callable[[Request], None]:
    """A dependency refusing each of `names` when the query gives it more than once."""

    def check(request: Request) -> None:
        for name in names:
            values = request.query_params.getlist(name)
            if len(values) > 1:
                raise RequestValidationError(
                    [{"type": "value_error", "loc": ("query", name), "input": values,
                      "msg": f"{name} given more than once ({len(values)} times): give it once"}]
                )  # fmt: skip

    return check
