"""``terse plan-pipeline`` with the pipeline benchmark's workloads: ``--model mlp|cnn|transformer``
calibrates the cost model from 12 uncompressed steps of that workload on 4 local ranks
(:func:`terse_harness.pipeline.calibrate_model`); every other option is terse.plan_pipeline's.
The ``terse`` command of a build tree runs this module when the harness of its source tree is
there; ``python3 -m terse.plan_pipeline`` alone takes ``--profile``.

    PYTHONPATH=bench python3 -m terse_harness.plan_pipeline --model cnn --link 100mbit
"""

import sys
from typing import List, Optional

from terse import plan_pipeline

from terse_harness import pipeline


def main(argv: Optional[List[str]] = None) -> int:
    return plan_pipeline.main(argv, models=list(pipeline.MODELS),
                              calibrate=pipeline.calibrate_model)


if __name__ == "__main__":
    sys.exit(main())
