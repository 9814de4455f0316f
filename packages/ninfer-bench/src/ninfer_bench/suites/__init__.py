"""The serving suites: context, corpus and the two concurrency suites."""
