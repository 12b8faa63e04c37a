"""Runs one e2e test module for ctest: `python3 -m unittest` semantics, plus exit
code 77 (ctest's SKIP_RETURN_CODE) when every test in it skipped, so a missing
feature shows as "Skipped" with its reason instead of a silent pass."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    names = sys.argv[1:]
    suite = unittest.defaultTestLoader.loadTestsFromNames(names)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    for test, reason in result.skipped:
        print(f"SKIPPED {test}: {reason}")
    if not result.wasSuccessful():
        return 1
    # A class skipped in setUpClass adds a skip without running tests.
    skipped_tests = sum(1 for t, _ in result.skipped if isinstance(t, unittest.TestCase))
    passed = result.testsRun - skipped_tests - len(result.expectedFailures)
    if result.skipped and passed <= 0:
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main())
