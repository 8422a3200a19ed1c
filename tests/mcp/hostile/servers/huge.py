"""Answers with a result far larger than any client should take in."""
from mcp.server.mcpserver import MCPServer

server = MCPServer("huge")


@server.tool()
def flood() -> str:
    """64 MiB of text in one answer."""
    return "x" * (64 * 1024 * 1024)


@server.tool()
def ok() -> str:
    """Answers at once."""
    return "ok"


server.run("stdio")
