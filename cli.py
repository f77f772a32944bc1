"""What every script's command line shares (torch-free: data preparation's workers import it)."""
import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every default that is set."""

    def _get_help_string(self, action):
        unset = action.required or action.default is False or action.default in (None, "", [])
        return action.help if unset else super()._get_help_string(action)
