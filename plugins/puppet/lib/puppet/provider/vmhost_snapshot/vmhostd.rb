# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/provider'
require_relative '../../../puppet_x/vmhost/backup'

Puppet::Type.type(:vmhost_snapshot).provide(:vmhostd) do
  desc <<~DOC
    Talks to vmhostd over its Unix socket. Current state comes from one `vm.snapshots` per VM
    and socket (prefetch); a VM that does not exist (4040) has no snapshots. `ensure => present`
    is `vm.snapshot` (with `requires` and `timeout_s` when given), `ensure => absent` is
    `vm.snapshot_delete`. Nothing is sent in noop mode.
  DOC

  # client, socket, send_call, puppet_error (instances and prefetch are this provider's own:
  # snapshots are listed per VM).
  include PuppetX::Vmhost::Provider

  class << self
    # `puppet resource vmhost_snapshot`: every snapshot of every VM on the default socket.
    def instances
      socket = PuppetX::Vmhost.socket_path
      vms = Array(client(socket).call('vm.list'))
      vms.flat_map do |vm|
        snapshots_of(socket, vm['name']).map { |s| new(hash_from_view(vm['name'], s, socket)) }
      end
    end

    # One vm.snapshots per VM and socket. A VM whose snapshots cannot be read leaves its
    # resources unprefetched; each then fails on its own when it reads them.
    def prefetch(resources)
      resources.values.group_by { |r| [PuppetX::Vmhost.socket_path(r[:socket]), r[:vm]] }.each do |(socket, vm), group|
        begin
          views = snapshots_of(socket, vm)
        rescue PuppetX::Vmhost::Error => e
          Puppet.debug("vmhost_snapshot: prefetch of #{vm} from #{socket} failed: #{e.message}")
          next
        end
        group.each do |res|
          view = views.find { |s| s['name'] == res[:snapshot] }
          res.provider = new(view ? hash_from_view(vm, view, socket) : absent_hash(res, socket))
        end
      end
    end

    # VM's snapshot views; none when there is no such VM (4040 on name).
    def snapshots_of(socket, vm)
      Array(PuppetX::Vmhost::Backup.snapshots(vm, {}, client: client(socket))).select { |s| s.is_a?(Hash) }
    rescue PuppetX::Vmhost::DaemonError => e
      raise unless e.code == 4040 && e.field != 'snapshot'

      []
    end

    def hash_from_view(vm, view, socket)
      { name: "#{vm}/#{view['name']}", vm: vm, snapshot: view['name'], ensure: :present,
        consistency: view['consistency'], created_at: view['created_at'], socket: socket }
    end

    def absent_hash(res, socket)
      { name: res[:name], vm: res[:vm], snapshot: res[:snapshot], ensure: :absent, socket: socket }
    end
  end

  # The current state, read with vm.snapshots when prefetch did not provide it.
  def current
    return @property_hash unless @property_hash.empty?

    views = begin
      self.class.snapshots_of(socket, resource[:vm])
    rescue PuppetX::Vmhost::Error => e
      raise puppet_error(e)
    end
    view = views.find { |s| s['name'] == resource[:snapshot] }
    @property_hash =
      view ? self.class.hash_from_view(resource[:vm], view, socket) : self.class.absent_hash(resource, socket)
  end

  def exists?
    current[:ensure] == :present
  end

  def create
    opts = {}
    opts['requires'] = resource[:requires].to_s unless resource[:requires].nil?
    opts['timeout_s'] = resource[:timeout_s] unless resource[:timeout_s].nil?
    params = PuppetX::Vmhost::Backup.params({ 'name' => resource[:vm], 'snapshot' => resource[:snapshot] }, opts)
    view = send_call('vm.snapshot', params, PuppetX::Vmhost::Backup.wait('vm.snapshot', params))
    @property_hash = self.class.hash_from_view(resource[:vm], view, socket) if view.is_a?(Hash)
  end

  def destroy
    params = { 'name' => resource[:vm], 'snapshot' => resource[:snapshot] }
    send_call('vm.snapshot_delete', params, PuppetX::Vmhost::Backup.wait('vm.snapshot_delete', params))
    @property_hash = self.class.absent_hash(resource, socket)
  end

  private

  # What puppet_error adds to a refusal: how to get past it.
  def refusal_detail(err)
    case err.code
    when 4094
      '; the snapshot would be crash-consistent (requires => frozen): start the guest agent, or ' \
      'leave requires out to accept it'
    when 4040
      "; VM #{resource[:vm]} does not exist on this host"
    end
  end
end
