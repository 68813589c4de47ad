"""The cluster: its front end over many instances, instance handles (in process or Ray actors),
transfers and failure recovery. The only modules that import Ray."""
