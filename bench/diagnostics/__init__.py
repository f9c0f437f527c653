"""One-off readings of benchmark results (each a script with --help;
bench/README.md says what each answers)."""
