"""Tools built on the service (demo, status, simulator, bench, and the process harness they and the
tests share); the service never imports them."""
