"""An operator's measurements behind ``kvpool bench``, on their own machine, pool and traces; each reports ratios
against a ceiling measured in the same run. The lab's harnesses (engines, peers, trace generation) are the
scripts in the repository's ``benchmarks/``, not part of the package."""
