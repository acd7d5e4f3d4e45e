"""Extract the target's hidden states: `python extract.py --config config.toml [--section.key value]`."""
from eagle3.extraction import main

if __name__ == "__main__":
    main()
