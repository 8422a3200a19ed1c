"""Exits in the middle of a call."""
import os

from mcp.server.mcpserver import MCPServer

server = MCPServer("exits")


@server.tool()
def die() -> str:
    """Exits without answering."""
    os._exit(7)


@server.tool()
def ok() -> str:
    """Answers at once."""
    return "ok"


server.run("stdio")
