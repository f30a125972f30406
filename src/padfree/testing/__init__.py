"""Helpers a user's own tests can import: the kill-and-resume harness (``killresume``), the exactly-once
check of a seen-log (``seenlog``) and ranks as threads (``threadranks``). Tiny random-weight models are
public: :mod:`padfree.models`."""
