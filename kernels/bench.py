"""`python -m kernels.bench {attention,loss}`: benchmark tables for the TTT kernels on the GPU."""
import argparse


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__)
    parser.add_argument("which", choices=["attention", "loss"])
    parser.add_argument("--shapes", default="all", help="comma-separated shape labels (a,b,c) or 'all'")
    args = parser.parse_args()
    if args.which == "attention":
        from kernels.bench_attention import run
    else:
        from kernels.bench_loss import run
    run(args.shapes)


if __name__ == "__main__":
    main()
