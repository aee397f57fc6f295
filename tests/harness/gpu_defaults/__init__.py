"""Stand-ins for what only a GPU runs (the overlap scheduler, captured graphs), for the test suite."""
