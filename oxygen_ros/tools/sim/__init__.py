"""oxygen_ros.tools.sim: the simulation's commands: ``oxygen sim-eval`` (``eval.py``: the grid, workers, shards;
``realtime.py``: the cells over DDS; ``report.py``: measures, table, plots; ``video.py``: episode MP4s),
``oxygen sim-record`` (``record.py``: expert episodes -> episode bags) and ``oxygen demo`` (``demo.py``; the closed
loop in ``demo_loop.py``, the timeline plot both demos draw in ``demo_timeline.py``)."""
