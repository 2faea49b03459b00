"""Pipeline parallelism the two pipelined back ends share: :mod:`.stages` (pure arithmetic: cutting an ordered
list of layers into stages, DeepSpeed's cuts) and :mod:`.checks` (what both refuse before building anything: a
weight two stages would hold)."""
