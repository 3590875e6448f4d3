"""``python -m services.scheduler``: run the scheduler service."""

from torchrelay.service import run_service

from .service import setup


def main() -> None:
    """Run the scheduler until SIGTERM."""
    run_service("scheduler", setup)


if __name__ == "__main__":
    main()
