"""The project's tools that are neither shipped nor tests (run from the repository root)."""
