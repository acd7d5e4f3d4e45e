"""Train an EAGLE-3 draft: `python train.py --config config.toml` or
`torchrun --nproc_per_node 8 train.py --config config.toml [--section.key value]`."""
from eagle3.training import main

if __name__ == "__main__":
    main()
