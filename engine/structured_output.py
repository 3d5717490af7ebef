"""What a request's output must match: the constraint a request names (this record), which
engine.sampling.grammar compiles and enforces with a token bitmask in the sampler."""

from __future__ import annotations

import json
from dataclasses import dataclass

# The constraint kinds, in the order the wire's oneof lists them.
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    """A constraint that cannot be used: its `name` is the field at fault."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One constraint on a request's output; exactly one of the fields is set.

    - `json_schema`: a JSON Schema document (its text); the output is one JSON value
      that validates against it.
    - `json_object`: any JSON object.
    - `regex`: the whole output matches this regular expression.
    - `choice`: the output is exactly one of these strings.
    - `grammar`: an EBNF grammar (GBNF: `root ::= ...`).

    JSON output is compact by default (no whitespace between tokens, as OpenAI's
    structured outputs), so it ends: a small model in a JSON mode with free whitespace
    may emit blanks until max_tokens. `pretty_json` allows newlines and indentation,
    at most a newline and 16 spaces, or one space, at a time (engine.sampling.grammar).
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    pretty_json: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise StructuredOutputError("choice", "choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(self.choice):
                raise StructuredOutputError("choice", "choice must list at least one non-empty string")
        kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(kinds) != 1:
            raise StructuredOutputError("structured_output",
                                        f"set exactly one of {', '.join(KINDS)}, got {kinds or 'none'}")
        for kind in ("json_schema", "regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise StructuredOutputError(kind, f"{kind} must be a non-empty string")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except (json.JSONDecodeError, RecursionError) as error:
                raise StructuredOutputError("json_schema", f"json_schema is no JSON: {str(error)[:200]}") from None
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError("json_schema", "json_schema must be a JSON object")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on: the grammar cache's key."""
        return (self.kind, getattr(self, self.kind), self.pretty_json)
