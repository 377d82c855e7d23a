"""What every opkit callback shares; imports no feature package.

- :mod:`.callback`: :class:`~.callback.OpkitCallback`, the base (writer, patches, summary, teardown alike).
- :mod:`.logging`: the one sink: TensorBoard first, and the Trainer's other loggers; the tag table; markdown tables.
- :mod:`.summary`: the run summary and the custom-scalars layout.
- :mod:`.kit`: how a callback finds the others of its Trainer, by what they offer.
- :mod:`.patch`: reversible attribute patches and hook handles; scope counters.
- :mod:`.ranks`: decisions taken together by every rank.
- :mod:`.replay`: running a training step again without a trace; the training step as a loss.
- :mod:`.suspend`: opkit's function modes standing aside while compiled code is built and run.
- :mod:`.select`: module-path globs, and the model's repeated blocks.
- :mod:`.checks`: constructor-argument checks.
- :mod:`.timing`: device synchronization and timing on the device's clock.
- :mod:`.text`: reasons, ratios and exception summaries as opkit words them.
- :mod:`.dtypes`: dtype names and casts; a module held in fp32.
"""
