"""`extproc calibrate`: find a class's concurrency cap by a closed-loop load sweep against the target."""
