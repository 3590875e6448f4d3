"""``python -m services.billing``: run the billing service."""

from torchrelay.service import run_service

from .service import setup


def main() -> None:
    """Run the billing service until SIGTERM."""
    run_service("billing", setup)


if __name__ == "__main__":
    main()
