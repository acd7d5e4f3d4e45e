"""`python -m eagle3.bench [step] [options]` or `python -m eagle3.bench {attention,loss} [options]`."""
import importlib
import sys

BENCHES = ("step", "attention", "loss")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # the training step is the default, so `torchrun -m eagle3.bench --kernels ...` needs no name
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: python -m eagle3.bench [{'|'.join(BENCHES)}] [options]\n\nbenches: {', '.join(BENCHES)} "
              "(each takes --help; `step`, the training step, is the default)")
        raise SystemExit(0)
    name, rest = (argv[0], argv[1:]) if argv[:1] and argv[0] in BENCHES else ("step", argv)
    importlib.import_module(f"eagle3.bench.{name}").main(rest)


if __name__ == "__main__":
    main()
