"""Structured results from a worker rank to its test.

report(event, **fields) appends one JSON object, {"event": event, **fields}, as a line to the
file tests/world.py names in SMDDP_TEST_REPORT (one per rank); the test reads them as
RankResult.reports instead of parsing stdout. Each line is written and closed at once, so a
rank killed later still reports what it did before. Without SMDDP_TEST_REPORT (a worker run
by hand, or by a benchmark) the line goes to stdout after "REPORT ".
"""
import json
import os


def report(event: str, **fields) -> None:
    line = json.dumps({"event": event, **fields})
    path = os.environ.get("SMDDP_TEST_REPORT")
    if not path:
        print("REPORT " + line, flush=True)
        return
    with open(path, "a") as f:
        f.write(line + "\n")
