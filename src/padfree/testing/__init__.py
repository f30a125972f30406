"""Helpers a user's own tests can import: the kill-and-resume harness (``killresume``) and the exactly-once
check of a seen-log (``seenlog``). Tiny random-weight models are public: :mod:`padfree.models`."""
