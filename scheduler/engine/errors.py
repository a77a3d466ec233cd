"""Errors as a caller sees them: trio groups what a task group's tasks raised, and a user of
``open_engine`` or ``LLM`` should meet the error itself, as vLLM's users do, not a group of one.
"""

from __future__ import annotations

import trio


def leaves(e: BaseException) -> list[BaseException]:
    """The errors inside (nested) groups, in order; an error alone is its own leaf."""
    if isinstance(e, BaseExceptionGroup):
        return [x for sub in e.exceptions for x in leaves(sub)]
    return [e]


def plain_error(e: BaseException, more: str = "errors of this type came with it") -> BaseException:
    """What to raise for ``e``: an interrupt (KeyboardInterrupt, SystemExit) found in it, which
    outranks what it caused; else its one error, or the first of several of one type (noting
    how many more: ``more`` says what they are); else the group itself. Cancellations, the
    group's own clean-up, are not errors of their own."""
    if not isinstance(e, BaseExceptionGroup):
        return e
    found = [x for x in leaves(e) if not isinstance(x, trio.Cancelled)]
    for kind in (KeyboardInterrupt, SystemExit):
        hit = next((x for x in found if isinstance(x, kind)), None)
        if hit is not None:
            return hit
    if found and len({type(x) for x in found}) == 1:
        if len(found) > 1:
            found[0].add_note(f"({len(found) - 1} more {more})")
        return found[0]
    return e
