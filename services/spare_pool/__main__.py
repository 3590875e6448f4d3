"""``python -m services.spare_pool``: run the spare-pool service."""

from torchrelay.service import run_service

from .service import SparePoolSettings, setup


def main() -> None:
    """Run the spare pool until SIGTERM."""
    run_service("spare_pool", setup, SparePoolSettings)


if __name__ == "__main__":
    main()
