"""Command line: ``python -m tokengym demo [--iterations N]``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    """Parse the command and run it."""
    parser = argparse.ArgumentParser(prog="tokengym")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny offline model with tokengym + TorchRL's ClipPPOLoss")
    demo.add_argument("--iterations", type=int, default=None, help="collected batches to train on")
    demo.add_argument("--out-dir", default="demo_out", help="where the reward curve PNG goes")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from tokengym._demo import DemoConfig
        from tokengym._demo import main as run_demo

        config = DemoConfig(out_dir=args.out_dir)
        if args.iterations is not None:
            if args.iterations <= 0:
                parser.error(f"--iterations must be positive, got {args.iterations}")
            config = DemoConfig(iterations=args.iterations, out_dir=args.out_dir)
        run_demo(config)


if __name__ == "__main__":
    main()
