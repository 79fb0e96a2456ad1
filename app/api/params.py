"""Query parameters held to what the OpenAPI document says of them: one value (given
twice, the request is refused with a 422 naming the parameter, instead of one of the
values being taken silently), and integers written as integers."""

from __future__ import annotations

import re
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


# what JSON Schema's `integer` means for a query value: ASCII digits with an optional minus
# sign. pydantic's lax mode also takes `+1`, `1_0`, ` 1`, `1.0` and trailing Unicode spaces.
_INTEGER = re.compile(r"-?[0-9]+")


def single_valued_integers(*names: str) -> Callable[[Request], None]:
    """`single_valued`, and each of `names`, when given, written as a plain integer."""
    once = single_valued(*names)

    def check(request: Request) -> None:
        once(request)
        for name in names:
            value = request.query_params.get(name)
            if value is not None and _INTEGER.fullmatch(value) is None:
                raise RequestValidationError(
                    [{"type": "int_parsing", "loc": ("query", name), "input": value,
                      "msg": f"{name} must be written as an integer (digits only)"}]
                )  # fmt: skip

    return check
