"""Helper modules of the bench/ scripts (imported as bench.lib.NAME; none
is run on its own). bench/README.md lists what each script measures."""
