"""What each phase did, in the run record: applied, skipped (why) or fell back (why)."""

from typing import Any


def applied(**details: Any) -> dict[str, Any]:
    return {"status": "applied", "reason": None, **details}


def skipped(reason: str, **details: Any) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason, **details}


def fallback(reason: str, **details: Any) -> dict[str, Any]:
    return {"status": "fallback", "reason": reason, **details}
