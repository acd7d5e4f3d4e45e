"""`python -m eagle3.bench [step options]` or `python -m eagle3.bench quality [options]`."""
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["quality"]:
        from eagle3.bench.quality import main as quality
        quality(argv[1:])
    else:
        from eagle3.bench.step import main as step
        step(argv[1:] if argv[:1] == ["step"] else argv)


if __name__ == "__main__":
    main()
