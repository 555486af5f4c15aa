# frozen_string_literal: true

require 'json'
require 'socket'
require 'tmpdir'

# A fake vmhostd for the unit tests: a UNIXServer served by a Ruby thread. Each connection's
# first line is parsed and recorded in #requests, then the handler decides the answer: a Hash
# (sent as one JSON line, with the request's id unless it has an 'id' member), a String (sent
# as is), :hang (nothing, the connection stays open), or :close (closed without a word).
class FakeVmhostd
  attr_reader :path, :requests

  def initialize(&handler)
    @dir = Dir.mktmpdir('vmhfake')
    @path = File.join(@dir, 'vmhostd.sock')
    @server = UNIXServer.new(@path)
    @handler = handler || ->(_req) { { 'result' => nil } }
    @requests = Queue.new
    @held = []
    @thread = Thread.new { serve }
  end

  def request_list
    list = []
    list << @requests.pop until @requests.empty?
    list
  end

  def methods_called
    request_list.map { |r| r['method'] }
  end

  def close
    @thread.kill
    @thread.join
    @held.each(&:close)
    @server.close
    FileUtils.remove_entry(@dir)
  end

  private

  def serve
    loop do
      conn = @server.accept
      line = conn.gets
      if line.nil?
        conn.close
        next
      end
      req = JSON.parse(line)
      @requests << req
      reply(conn, req, @handler.call(req))
    end
  end

  def reply(conn, req, answer)
    case answer
    when :hang then @held << conn
    when :close then conn.close
    when String
      conn.write(answer)
      conn.close
    else
      msg = { 'jsonrpc' => '2.0', 'id' => req['id'] }.merge(answer)
      conn.write("#{JSON.generate(msg)}\n")
      conn.close
    end
  rescue SystemCallError, IOError
    conn.close
  end
end
