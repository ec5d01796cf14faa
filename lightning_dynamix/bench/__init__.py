"""Benchmarks behind ``dynamix bench``: measured comparisons, run as real jobs on this machine.

Each benchmark is the module named for its command (``dynamix bench balance`` is :mod:`.balance`), with
``add_arguments(parser)`` and ``run(args)``; :mod:`lightning_dynamix.cli.main` lists them. What they share:

* :mod:`.rounds`: every variant measured in interleaved rounds;
* :mod:`.arguments`: the command-line types; :mod:`.records`: the machine and arguments each result records;
* :mod:`.harness`: one heterogeneous training run (``balance``, ``tta`` and ``dynamix demo``), on the cluster of
  :mod:`.cluster_runs` (contention from :mod:`.contention`, hosts on shaped links from :mod:`.hosts`, load changes
  from :mod:`.load`), judged against the best fixed split of :mod:`.oracle`, plotted by :mod:`.plots`;
* :mod:`.cluster`: torch elastic's agents as local nodes (``elastic``);
* :mod:`.timing`: per-rank step times.

Entry points run as processes of a benchmark: :mod:`.host_rank`, :mod:`.elastic_worker`, :mod:`.overhead_worker`.
"""
