"""`make bench`: bench/run.py prints one table of issue 10's targets (see its docstring)."""
