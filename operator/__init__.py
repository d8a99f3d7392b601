"""kvpilot operator: arrives with the operator issue."""
