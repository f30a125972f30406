"""Helpers a user's own tests can import: tiny random-weight models (``models``), the kill-and-resume
harness (``killresume``) and the exactly-once check of a seen-log (``seenlog``)."""
