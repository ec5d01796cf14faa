"""Benchmarks behind ``dynamix bench``: measured comparisons, run as real jobs on this machine.

* :mod:`.core`: ``overhead`` and ``hook``, and the machine and arguments every benchmark records;
* :mod:`.heterogeneity`: ``balance`` and ``tta``, on the heterogeneous runs of :mod:`.experiments`
  (also ``dynamix demo``'s), plotted by :mod:`.plots`;
* :mod:`.offload`, :mod:`.placement`, :mod:`.plan`, :mod:`.replan`: ``offload``, ``placement``, ``plan``
  and ``replan``;
* :mod:`.policy`: ``policy``, the learned controller's decision time;
* :mod:`.elastic`: ``elastic``, torch elastic jobs on the local nodes of :mod:`.cluster`, each
  worker :mod:`.elastic_worker`;
* :mod:`.timing`: per-rank step times.
"""
