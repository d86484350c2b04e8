"""JSON from a client, parsed one way for /ws frames and /v1 bodies.

json.loads takes things that later break the server far from where they came in: an
integer of more than 4,300 digits raises a ValueError that is no JSONDecodeError (a 500),
and a lone UTF-16 surrogate ("\\ud800") parses into a str that cannot be encoded again, so
the tokenizer, or the error frame that echoes an id, fails on it (a 500, `internal`, a
dead socket). Both are the client's mistake: BadJSON, with a message fit to show.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

# Where a lone surrogate could be: any \uD800-\uDFFF escape (a pair is fine, and checked
# exactly below; this only spares the check to texts without one).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


class BadJSON(ValueError):
    """Client JSON we refuse; str() says why."""


def loads(raw: str | bytes) -> Any:
    """Parse a client's JSON. Raises BadJSON."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise BadJSON("malformed JSON: it nests too deeply") from None
    except json.JSONDecodeError as exc:
        raise BadJSON(f"malformed JSON: {exc}") from None
    except UnicodeDecodeError:
        raise BadJSON("the body is not valid UTF-8") from None
    except ValueError:  # int(): more digits than Python converts
        limit = sys.get_int_max_str_digits()
        raise BadJSON(f"a number has more than {limit} digits") from None
    escape = _SURROGATE_ESCAPE if isinstance(raw, str) else _SURROGATE_ESCAPE_BYTES
    if escape.search(raw):  # type: ignore[arg-type]
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadJSON(
                "the text holds a lone UTF-16 surrogate (an escape in \\ud800-\\udfff not "
                "part of a pair): send valid Unicode"
            ) from None
    return data
