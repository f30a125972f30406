"""padfree's own test fixtures that the tests and the benchmarks share, kept out of the wheel: importing the
drafter trainers' packages (``peers``) and building their models and features beside padfree's
(``drafters``). Tests find it on ``sys.path`` through tests/; benchmarks through :mod:`lab`. Not a conftest:
a second conftest.py would shadow ``from conftest import ...``."""
