"""Tools built on the service (demo, status, simulator, bench); the service never imports them."""
