"""The cluster: its front end over many instances (``engine.py``, composed of parts that each own
their state: ``state``, ``steps``, ``dispatch``, ``transfers``, ``recovery``, ``availability``,
``node``), instance handles (in process or Ray actors) and starting a cluster. Only
``ray_actors`` imports Ray."""
