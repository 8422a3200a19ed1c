"""A call that never answers: it blocks the server's event loop, so not
even a ping is answered."""
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("silent")


@server.tool()
async def wait() -> str:
    """Never answers: a blocking sleep on the event loop."""
    time.sleep(3600)
    return "woke"


@server.tool()
def ok() -> str:
    """Answers at once."""
    return "ok"


server.run("stdio")
