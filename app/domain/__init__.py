"""Pure decisions and data shapes: no I/O, no clocks read, no libraries that talk to the world."""
