"""Gateway: the public baton.v1.Generation service; tokenizes, routes, detokenizes, streams."""
