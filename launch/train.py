"""Training entry point for launchers that want a script path:

    python launch/train.py --config configs/quickstart.yaml
    deepspeed --num_gpus 8 launch/train.py --config configs/gpt2-small-scse.yaml
    srun python launch/train.py --config configs/gpt2-small-scse.yaml train.max_steps=1000
"""

import sys

from scse_dist.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
