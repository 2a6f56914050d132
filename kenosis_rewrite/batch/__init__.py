"""Fleets of models: one op over a folder or a list of models, on this machine or on a Ray cluster.

    from kenosis_rewrite import batch

    outcomes = batch.run("models/", batch.ops.fix(), "fixed/", engine="ray")   # or engine="local", jobs=2
    print(batch.summary_table(outcomes))

* :func:`run` plans one job per model (:mod:`~kenosis_rewrite.batch.listing` finds them), skips
  those already done, hands the rest to an engine and returns an :class:`Outcome` per model.
* Engines: ``"local"`` processes (:mod:`~kenosis_rewrite.batch.local_engine`) or one Ray task per
  model (:mod:`~kenosis_rewrite.batch.ray_engine`; the ``ray`` extra), with retries when a worker dies.
* Ops (:mod:`~kenosis_rewrite.batch.ops`): ``fix``, ``quantize``, ``quantize_weights``, a command
  of the command line, or any picklable ``op(model_path, *output_paths)``.
* Resumable outputs (:mod:`~kenosis_rewrite.batch.jobs`): staged, then moved into place whole.

``kenosis-rewrite fix|quantize|quantize-weights|bench DIR OUT --engine local|ray`` is this package.
"""

from kenosis_rewrite.batch import ops
from kenosis_rewrite.batch.jobs import Outcome, exit_code, summary_table
from kenosis_rewrite.batch.listing import is_batch_input, list_models
from kenosis_rewrite.batch.runner import ENGINES, run

__all__ = ["run", "ENGINES", "Outcome", "summary_table", "exit_code", "list_models", "is_batch_input", "ops"]

from kenosis_rewrite._submodules import submodule_getattr  # noqa: E402 - after the public names

__getattr__ = submodule_getattr(__name__)
