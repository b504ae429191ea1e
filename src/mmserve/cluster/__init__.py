"""Many engines behind one API: replica processes, the router and their typed boundary."""
