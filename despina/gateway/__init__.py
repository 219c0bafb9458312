"""The HTTP gateway: KServe V2 / Triton HTTP, function URLs; requests go to Redis streams."""
