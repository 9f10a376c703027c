"""What the tests share (clusters, processes, chats, fakes, logins, waits): no test module imports another."""
